"""What the operator sees: StatsD, ``/metrics``, the 15-minute history, the access and
process logs, the admin API and the status page.

Imports only ``activator.core``: nothing here may change how a request is served.
"""
