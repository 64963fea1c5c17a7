"""A request's path: route by Host, forward to a peer or wait for a slot, send to the pod,
relay its answer (or tunnel after a 101), release the slot exactly once.

Imports every layer below it: ``core``, ``base``, ``front``, ``pods``, ``ops``, ``fleet``.
"""
