"""Tools beside the serving path: the serving benchmark client (`bench`, also `moe bench serve`) and the
expert-load report (`report`, `moe report`). Nothing in server.core or server.frontend imports them.

May import: the standard library and plotting/HTTP client libraries; from this project only what a client
of a running server needs.
"""
