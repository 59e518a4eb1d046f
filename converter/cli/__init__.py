"""The ``mpconvert`` command line."""
