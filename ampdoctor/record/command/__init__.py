"""``ampdoctor record -- COMMAND``: a command recorded without a change to its code.

Entered by the CLI through ``launch`` and by the command's interpreters through
``_bootstrap/``; it imports the recorder and the treatments, which never import it back.
Importing this package imports nothing (``launch`` is torch-free: the CLI imports it).

- ``launch``: the parent side: check the output, start the command with the bootstrap on its
  ``PYTHONPATH`` and the settings in ``AMPDOCTOR_*``, forward signals, say what was recorded
- ``settings``: what ``launch`` tells each process of the command, in ``AMPDOCTOR_*``
  variables (``launch`` re-exports it)
- ``child``: inside each Python process of the command: one recording per process
- ``lifeline``: the command dies with ``record`` (a SIGKILL to it stops the training): the
  parent-death signal for the command, a watch on ``record``'s pid below it
- ``written``: which run files this node's processes wrote (a list the children append to)
- ``keeper``: the node summary this node's ``record`` keeps while the command runs, and at exit
- ``_bootstrap/``: the ``sitecustomize`` every interpreter of the command runs: it waits for
  ``import torch``, then starts ``child``
"""
