"""The vgpuhost agent: a resident daemon serving the local API (JSON over HTTP on unix sockets)."""
