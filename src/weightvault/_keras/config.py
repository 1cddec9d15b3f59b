"""What a ``.keras`` archive's ``config.json`` asks Keras to build, vetted before it is.

Building a model from a config runs code the config names: a ``Lambda`` layer carries a
Python function (as bytecode, or by a registered name), and a custom class runs its own
``from_config``. Keras' ``safe_mode`` refuses only the bytecode. weightvault's
``load_model`` refuses both, and every class that is not Keras' own (registered with
``register_keras_serializable`` or not), unless the caller opts in: ``custom_objects``
names the classes it trusts, ``safe_mode=False`` trusts all.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._base.errors import FormatError

#: Packages whose classes Keras builds from a config without the user's own code.
KERAS_MODULES = ("keras", "keras_hub", "keras_cv", "keras_nlp")
#: Keras' built-in functions are saved with this module and looked up among Keras'.
BUILTINS = "builtins"
#: Classes that carry a Python function.
LAMBDAS = ("Lambda", "__lambda__")
FIX = (
    "Pass safe_mode=False (or name the class in custom_objects) only if you trust "
    "the file's author: building it runs their code"
)


def _is_keras(module: str) -> bool:
    return module == BUILTINS or module.split(".")[0] in KERAS_MODULES


def vet(config: str, where: str, custom_objects: Mapping[str, Any] | None, safe_mode: bool) -> Any:
    """The parsed config, once nothing in it would run code the caller did not allow.

    Args:
        config: The text of ``config.json``.
        where: The archive and member, for messages.
        custom_objects: Classes and functions the caller trusts, by name.
        safe_mode: Refuse ``Lambda`` layers and classes not in ``custom_objects``.

    Raises:
        FormatError: Not JSON, or a refused object (the message names it).
    """
    try:
        doc = json.loads(config)
    except (ValueError, RecursionError):
        raise FormatError(f"{where}: not valid JSON; save the model again") from None
    if not safe_mode:
        return doc
    trusted = set(custom_objects or {})
    stack: list[Any] = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        stack.extend(node.values())
        cls, module = node.get("class_name"), node.get("module")
        if not isinstance(cls, str):
            continue
        name = str(_layer_name(node) or cls)
        if cls in LAMBDAS:
            raise FormatError(
                f"{where}: {name!r} is a {cls} layer, which holds a Python function that "
                f"building the model would run; it is refused in safe mode. {FIX}"
            )
        registered = node.get("registered_name")
        if _custom(module, registered) and not {cls, registered} & trusted:
            raise FormatError(
                f"{where}: {name!r} is a custom object ({registered or f'{module}.{cls}'}) "
                f"that is not in custom_objects; it is refused in safe mode. {FIX}"
            )
    return doc


def _custom(module: Any, registered: Any) -> bool:
    """Whether a config entry names a class that is not Keras' own.

    A registered name (``package>Name``, what ``register_keras_serializable`` makes)
    wins over the module in Keras' lookup, so it is custom whatever module is given.
    """
    if isinstance(registered, str) and (">" in registered or module is None):
        return True
    return isinstance(module, str) and not _is_keras(module)


def _layer_name(node: Mapping[str, Any]) -> Any:
    inner = node.get("config")
    return inner.get("name") if isinstance(inner, dict) else None
