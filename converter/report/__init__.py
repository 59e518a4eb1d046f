"""The precision audit: built from ``node.meta`` only, rendered as JSON, Markdown, HTML and terminal tables."""
