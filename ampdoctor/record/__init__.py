"""The torch side: recording a run.

``recorder.Recorder`` is the facade behind ``ampdoctor.watch``, over its parts:

- ``journal``: the run file's rows; ``watched``: model, optimizers, scaler (``discovery``:
  the roots found in the first step; ``autocastnotes``: the autocast state they run in;
  ``mirrors``: an optimizer's master copies of the model's parameters)
- ``hooks``: the hook groups, attached together: ``scalerhooks``, ``modulehooks``,
  ``losshooks``, ``optimizerhooks``, over ``stepflow`` (the step log they share, the step
  boundaries), ``sampledstep`` (the sampled step's hooks and drain) and ``gradnorm``; each
  callback handed to its door in ``patches`` as a callable (its type in ``listener``; beside
  it ``patching``: the undoable handles and ``guard``, ``clipdoors``: the clips'
  doors, ``moduledoors``: the module hooks' doors)
- ``steplog`` and ``steps``: the step buffer and its rows; ``skips``: the skip decision, its syncs
- ``exits``: SIGTERM, atexit, fork
- what the hooks use: ``stats``, ``sampler`` (the sampled tier), ``readback``, ``amp_state``,
  ``compiled``, ``sharding``, ``torchcompat``, ``environment``, ``buffers`` (buffers non-finite
  at the start; frozen models' buffers beside the roots), ``handles`` (the script's names for
  its modules), ``opprobe`` (the op probe), ``flatloss`` (a sampled step when the loss stops
  falling), ``schedules`` (LR scheduler steps per optimizer step), ``fp8`` (what fp8 would do to
  each matmul's operands, on sampled steps; ``fp8layers``: the layers already in fp8 and their
  recipes; ``replicas``: which ranks hold an fp8 layer's operand whole, from the layout),
  ``objectives`` (each loss's and each optimizer's own curve), ``engines`` (DeepSpeed's engine
  and Megatron-core's grad scalers, into the GradScaler's columns), ``scaledloss`` (which scaled
  loss a backward is), ``callorder`` (a step's backward calls against GradScaler's: a scaled
  loss backwarded after ``unscale_``)
- ``forensic/``: the forensic tier (tier 3): the failing step replayed, its culprit named, the
  fixes tried on it (its own docstring lists its modules)
- ``command/``: ``ampdoctor record -- COMMAND``, the command recorded from outside (its own
  docstring lists its modules)
- ``apply/``: ``record --apply``: ``prescription`` (its forms, no torch), ``treatment`` (them
  applied in each process of the command), ``lrfactors`` (the LR factor a treatment set, which
  ``steplog`` reads); its own docstring lists its modules

Importing this package imports nothing (``command.launch`` is imported by the CLI without
torch).
"""
