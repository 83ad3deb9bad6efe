"""Tools that act before a long run, not after it.

* ``amp_step``: ``check_amp_step``, the AMP contract of one training step (public as
  ``ampdoctor.testing.check_amp_step`` and the pytest fixture ``amp_contract``);
* ``layer_parity``: ``parity(model, batch, dtype)``, which modules lose precision under
  autocast (public as ``ampdoctor.parity``); its result, ``parity_result.ParityResult``, is
  plain Python and numpy so that it renders (text, report) without torch;
* ``snapshot``: what both of them save and put back, so the caller's objects are unchanged;
* ``target``: ``SCRIPT[:FUNCTION]``, the user's function ``ampdoctor parity`` calls.

Importing this package imports nothing: torch comes with ``amp_step`` and ``layer_parity``.
"""
