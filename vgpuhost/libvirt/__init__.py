"""libvirt/: domain XML.

Owns: vgpuhost's domain metadata and the safe domain reader (domxml), the
hostdev forms and editing a domain document (domain), the jinja2 templates
(templating).  Must not: talk to libvirt (io/virt.py does), read the host, or
decide which devices a domain may have (callers pass them in).
"""
