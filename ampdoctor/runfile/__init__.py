"""The run file: its format (``schema``), writing and reading it (``store``). numpy + h5py only.

Example::

    from ampdoctor.runfile import store
    with store.load("run.h5") as run:
        print(run.meta.get("ampdoctor_version"), len(run.steps))
"""
