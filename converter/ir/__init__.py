"""The graph-level vocabulary every stage shares: node.meta records, precision names, op names, errors."""
