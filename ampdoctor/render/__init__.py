"""Rendering: text, markdown and HTML of the data objects (``diagnosis``, ``release``,
``fix_outcome``: a run against its fix; ``nodes``: ``ampdoctor index``'s line), the pieces
they share (``tables``), plots (``plots``, the only module that imports matplotlib) and
writing outputs (``files``).
"""

# Importing the package registers the renderers of the data objects with ampdoctor.display
# (plots stay unimported: matplotlib comes only when a figure is drawn).
from . import diagnosis, release  # noqa: E402,F401
