"""This process among the other holders of the slots, in the shell: the peer endpoint and
its checks (the rules: ``core.peering``, ``core.fleet``), and a worker's side of the one
queue across workers (the rules: ``core.slotexchange``).

Imports ``activator.core``, ``activator.base`` and ``activator.pods``.
"""
