"""The run file: its format (``schema``), writing and reading it (``store``). numpy + h5py only.

- ``store``: the front door (``Writer``, ``load``), over ``writer`` (rows appended,
  crash-safe; ``descriptor``: the OS descriptor beneath its file, after a failed write) and
  ``reader`` (``load`` -> ``run``'s ``Run``, its /steps held column by column in ``columns``,
  a finished file's tables inflated on two threads by ``inflate``; ``tail``: the rows added
  since the last read, for ``top``)
- ``schema``: the tables and codes; ``migrations``: older versions' tables lifted into it;
  ``payloads``: the JSON payloads, declared; ``records``: the frozen dataclasses nested in
  them, ``detail`` those of a snapshot's detail and ``meta`` those of /meta; ``values``: the
  values a row may hold
- what a file is: ``attributes`` (its root attributes), ``hdf5`` (the format beneath h5py),
  ``guard`` (nothing read from outside the file), ``liveness`` (is its writer alive)
- many files: ``paths`` (rank, pid and node file names), ``summary`` (a run in a few numbers),
  ``nodes`` (one node's rank summaries in one file; ``ampdoctor index``)

Example::

    from ampdoctor.runfile import store
    with store.load("run.h5") as run:
        print(run.meta.get("ampdoctor_version"), len(run.steps))
"""
