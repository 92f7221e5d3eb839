"""Typed configuration: dataclass schemas loaded from YAML with dotlist overrides."""

from xnn.config.loader import (
    ConfigError,
    check_choice,
    check_finite,
    check_range,
    describe,
    field,
    load_config,
    save_config,
    to_yaml,
    validate,
    validate_choices,
)

__all__ = [
    "ConfigError",
    "load_config",
    "save_config",
    "to_yaml",
    "describe",
    "field",
    "check_choice",
    "check_range",
    "check_finite",
    "validate",
    "validate_choices",
]
