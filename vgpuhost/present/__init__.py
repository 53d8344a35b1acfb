"""The documents the CLI and the agent both serve (JSON shapes and their schema ids), and the request
parsing they share.  Above ``hook``, below ``cli`` and ``agent``; imports neither."""
