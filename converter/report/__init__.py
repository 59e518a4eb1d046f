"""The precision audit: built from ``node.meta`` only, rendered as JSON, Markdown, HTML and terminal tables.

``build`` makes the :class:`~converter.report.build.Report` (report.json) with FLOPs from ``flops``; the renderings
(``markdown``, ``html`` with its CSS/JS in ``assets/`` and the matplotlib figures of ``plots``, ``terminal``,
``explain``) share ``common`` and never import ``build`` back; ``render`` gathers them and writes the files.
"""
