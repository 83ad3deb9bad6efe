"""Keep the AMP contract in your own tests: ``check_amp_step`` and the pytest fixture
``amp_contract``.

``check_amp_step(train_step, model, optimizer, scaler, batch)`` runs your one-step function
twice with ampdoctor watching and raises ``AssertionError`` naming each broken rule (clip
before ``unscale_``, ``optimizer.step()`` bypassing the scaler, ``step`` without ``update``,
``unscale_`` twice, a scaler re-created, gradients not zeroed, the LR scheduler stepped on a
skipped step, fp16 autocast without a GradScaler, an fp16 loss), each with its fix snippet.
Your model, optimizer, scaler, schedulers and RNG are unchanged afterwards. See
``ampdoctor.preflight.amp_step`` for how it runs.

Plain function::

    from ampdoctor.testing import check_amp_step

    def test_train_step_keeps_the_amp_contract():
        model, optimizer = make_model()
        check_amp_step(train_step, model, optimizer, torch.amp.GradScaler("cuda"), batch)

pytest fixture: installing ampdoctor registers this module as a pytest plugin (entry point
``pytest11``), so ``amp_contract`` is there in any test; with plugin autoloading off
(``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), add ``pytest_plugins = ["ampdoctor.testing"]`` to your
``conftest.py``::

    def test_train_step(amp_contract):
        amp_contract(train_step, model, optimizer, scaler, batch)

Importing this module imports neither torch nor pytest: torch comes with the first check, and
the fixture is defined only where pytest is already imported (a pytest run).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .preflight.amp_step import AmpContractError

__all__ = ["AmpContractError", "check_amp_step"]


def check_amp_step(train_step: Callable[..., Any], model: Any, optimizer: Any,
                   scaler: Any = None, batch: Any = None) -> None:
    """Run ``train_step(model, optimizer, scaler, batch)`` twice under watch; raise
    ``AssertionError`` if it breaks the AMP contract (see
    ``ampdoctor.preflight.amp_step.check_amp_step``)."""
    from .preflight.amp_step import check_amp_step as _check

    _check(train_step, model, optimizer, scaler, batch)


def __getattr__(name: str) -> Any:
    if name == "AmpContractError":
        from .preflight.amp_step import AmpContractError

        return AmpContractError
    raise AttributeError(f"module 'ampdoctor.testing' has no attribute {name!r}")


if "pytest" in sys.modules:  # a pytest run loading this plugin: the fixture, for free
    import pytest

    @pytest.fixture
    def amp_contract() -> Callable[..., None]:
        """``check_amp_step`` as a fixture: ``amp_contract(train_step, model, optimizer,
        scaler, batch)`` fails the test with each violation and its fix."""
        return check_amp_step

    __all__.append("amp_contract")
