"""Named extension points of the algorithm zoo: one `Registry` per kind of pure tensor function.

A registry maps a name ("grpo", "ppo", "k3", ...) to a function with the kind's documented
signature. Configs select a built-in by name, or point at a user's own function with a dotted path
("my_pkg.losses.my_loss"), which `resolve` imports and checks against the same signature, so a
mismatch fails at start-up with a message naming the path, the wrong parameters and the expected
signature instead of a TypeError deep inside a training step (DESIGN.md section 5.3; slime's
plugin contracts, verl's `register_policy_loss` / `register_adv_est`).

The registries themselves live next to their built-ins: `advantages.ADVANTAGES`,
`policy_losses.POLICY_LOSSES`, `kl.KL_ESTIMATORS`, `aggregation.AGGREGATIONS`,
`filters.SAMPLE_FILTERS`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


class Registry:
    """Name -> callable for one kind of function, with the kind's required parameter names.

    `params` are passed positionally by the caller, in this order; `keyword_only` are passed by
    keyword. A registered or resolved function must take exactly these required parameters (it
    may add optional ones with defaults).
    """

    def __init__(self, kind: str, params: Sequence[str], keyword_only: Sequence[str] = (),
                 returns: str = "") -> None:
        self.kind = kind
        self.params = tuple(params)
        self.keyword_only = tuple(keyword_only)
        self.returns = returns
        self._entries: dict[str, Callable[..., Any]] = {}

    @property
    def signature(self) -> str:
        """The expected signature as text, for error messages and docs."""
        args = ", ".join(self.params)
        if self.keyword_only:
            args += ", *, " + ", ".join(self.keyword_only)
        return f"fn({args})" + (f" -> {self.returns}" if self.returns else "")

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def register(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator: register `fn` under `name` after checking its signature."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._entries:
                raise ValueError(f"{self.kind} '{name}' is already registered "
                                 f"({self._entries[name].__module__}.{self._entries[name].__qualname__})")
            self.check_signature(fn, f"built-in {self.kind} '{name}'")
            self._entries[name] = fn
            return fn

        return decorate

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as `name`; ValueError listing the known names otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} '{name}'; known: {', '.join(self.names())}. "
                f"Or give a dotted path 'package.module.function' to your own function with "
                f"signature {self.signature}") from None

    def resolve(self, spec: str | Callable[..., Any]) -> Callable[..., Any]:
        """A registered name, a dotted path "package.module.function", or a callable -> checked fn."""
        if callable(spec):
            self.check_signature(spec, f"{self.kind} {getattr(spec, '__qualname__', spec)!r}")
            return spec
        if spec in self._entries or "." not in spec:
            return self.get(spec)
        fn = _import_dotted(spec, self.kind)
        self.check_signature(fn, f"{self.kind} '{spec}'")
        return fn

    def check_signature(self, fn: Callable[..., Any], where: str) -> None:
        """ValueError unless `fn` takes this registry's parameters (names, order, kinds)."""
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: cannot read its signature ({err}); "
                             f"expected {self.signature}") from None
        problems = self._signature_problems(list(sig.parameters.values()))
        if problems:
            raise ValueError(f"{where} has signature {_format_params(sig)} but a {self.kind} must be "
                             f"{self.signature}: {'; '.join(problems)}")

    def _signature_problems(self, params: list[inspect.Parameter]) -> list[str]:
        by_name = {p.name: p for p in params}
        var_pos = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
        expected = set(self.params) | set(self.keyword_only)
        missing = [n for n in self.params if n not in by_name and not var_pos]
        missing += [n for n in self.keyword_only if n not in by_name and not var_kw]
        extra = [p.name for p in params if p.name not in expected and p.kind not in _VARIADIC
                 and p.default is inspect.Parameter.empty]
        problems = []
        if missing:
            problems.append(f"missing parameters: {', '.join(missing)}")
        if extra:
            problems.append(f"unexpected required parameters: {', '.join(extra)}")
        # the caller passes `params` by position, so they must come first and in this order
        positional = [p.name for p in params if p.kind in _POSITIONAL]
        n = min(len(positional), len(self.params))
        if not missing and positional[:n] != list(self.params[:n]):
            problems.append(f"positional parameters start ({', '.join(positional[:len(self.params)])}), "
                            f"expected ({', '.join(self.params)})")
        wrong_kind = [n for n in self.params if n in by_name and by_name[n].kind not in _POSITIONAL]
        wrong_kind += [n for n in self.keyword_only
                       if n in by_name and by_name[n].kind is inspect.Parameter.POSITIONAL_ONLY]
        if wrong_kind:
            problems.append(f"cannot be passed as the caller does: {', '.join(wrong_kind)}")
        return problems


def _import_dotted(path: str, kind: str) -> Callable[..., Any]:
    """Import "package.module.function"; ValueError naming the path when any part is missing."""
    module_name, _, attr = path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{kind} '{path}': cannot import module '{module_name}' ({err}); "
                         f"check the dotted path and that the package is on PYTHONPATH") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"{kind} '{path}': module '{module_name}' has no attribute '{attr}'")
    if not callable(fn):
        # a config mistake like every other resolve failure: one exception type for callers
        raise ValueError(f"{kind} '{path}' is a {type(fn).__name__}, not a function")  # noqa: TRY004
    return fn


def _format_params(sig: inspect.Signature) -> str:
    """`(a, b, *, c=1)` without annotations, which only clutter the message."""
    plain = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=plain, return_annotation=inspect.Signature.empty))
