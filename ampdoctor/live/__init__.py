"""Watching a run while it is recorded: ``ampdoctor top`` and ``ampdoctor export``.

* ``follow``: the files of a recording (``run.h5`` or its rank files) followed poll by poll,
  reading only new rows from a file being written, and whether its writer is still there;
* ``frame``: one frame of the live view as plain data, from the same functions the reports use;
* ``top``: the terminal view and its loop (standard library only); ``fp8top``: its lines for
  the Linears at risk in fp8;
* ``tensorboard``: the run's curves as TensorBoard event files (the ``tensorboard`` extra);
  ``tfrecord``: the event file itself, its records checksummed by numpy a batch at a time;
  ``thinning``: which points of a month-long run's curves it writes.

Like the rest of the analysis side, none of it imports torch.

Example::

    from ampdoctor.live import follow, frame
    with follow.Follower("run.h5") as f:
        f.poll()
        print(frame.build(f.states).to_dict()["step"])
"""
