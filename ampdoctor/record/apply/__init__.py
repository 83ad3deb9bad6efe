"""``ampdoctor record --apply``: a fix applied to the whole command, no code change. Unlike the
recorder, a treatment changes what the run computes, on purpose.

- ``prescription``: the ``--apply`` forms (``FORMS``), parsed and checked in the parent before
  the command starts, carried to its processes in ``AMPDOCTOR_APPLY`` (no torch: the CLI
  imports it);
- ``treatment``: the prescriptions applied in each process of the command, as patches
  installed from the bootstrap before the recorder starts (``INSTALL``, derived from
  ``FORMS``);
- ``lrfactors``: the LR factor a treatment sets on an optimizer, which the step log reads: the
  one seam between a treatment and the recorder.

This package's ``__init__`` imports nothing, so that the CLI reads the forms without torch.
"""
