"""The running process: the server and its listeners, reloads and the config file, signals,
systemd, the workers' supervisor, the demo.

Assembles every layer below it; nothing below imports it.
"""
