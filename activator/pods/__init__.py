"""The pod side: the HTTP/1.1 keep-alive pools, the h2c connections with one stream per
request, which client a pod gets, and the active probes.

Imports ``activator.core`` and ``activator.base``.
"""
