"""What the chapters simulate: drivers and workloads that sit on the core.

``sim`` imports the core and never ``views``, ``checks`` or ``bench``.
"""
