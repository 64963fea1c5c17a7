"""The client side: listeners, HTTP/1.x on llhttp, HTTP/2 on ``h2``, TLS with ALPN, and
noticing a client that hung up. Turns bytes from clients into exchanges and exchanges
into bytes back.

Imports ``activator.core`` and ``activator.base``.
"""
