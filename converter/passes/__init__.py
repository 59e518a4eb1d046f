"""The graph passes: capture, decide, place, rewrite and lower. Each reads and writes ``node.meta``."""
