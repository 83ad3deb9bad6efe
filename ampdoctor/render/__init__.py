"""Rendering: text, markdown and HTML of the data objects (``diagnosis``, ``release``), plots
(``plots``, the only module that imports matplotlib) and writing outputs (``files``).
"""
