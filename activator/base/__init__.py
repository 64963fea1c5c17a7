"""What every part of the shell stands on: the exchange values (a client's request and a
pod's answer, whatever the protocol), the one HTTP/2 driver, the deadlines greenlet, the
one topology writer and the wait for a slot.

Decides nothing about HTTP or the fleet by itself. Imports only ``activator.core``.
"""
