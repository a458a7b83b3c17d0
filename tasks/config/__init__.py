"""The `pipeline.toml` schema and the values it shares with the CLI, as a package:

- `errors`: `MemplanError` (a user-facing failure) and `ConfigError`;
- `values`: budgets, `--option KEY=VALUE` assignments, overhead limits, the names values are checked against;
- `sections`: the tables (models, profile, plans, validate, publish), defaults documented next to each field;
- `fleet`: the device classes and deployment (docs/fleet.md);
- `schema`: `PipelineConfig` and `load_config(path)`, whose errors (`ConfigError`) name the file, the key
  path, the bad value and what is allowed;
- `matrix`: `expand_matrix(config)`, the (model, batch size, plan, budget) `Case`s a run solves.
"""

from __future__ import annotations

from memplan.tasks.config.errors import ConfigError, MemplanError
from memplan.tasks.config.values import (
    Budget, DEVICE, DTYPES, IMPORT_PATH, MAX_BUDGET_BYTES, MAX_OVERHEAD, MIN_DEVICE_MEMORY, NAMED_LOSSES,
    TRANSFORMERS_AUTO_CLASSES, parse_budget, parse_budget_text, parse_device_memory, parse_device_memory_text,
    parse_max_overhead,
    parse_option_text,
)
from memplan.tasks.config.sections import (
    Addresses, InputSpec, ModelConfig, PlanConfig, PlanForm, PlanSettings, ProfileConfig, PublishConfig, Section, ValidateConfig,
    VARIANT_RULES,
    VariantChoice,
)
from memplan.tasks.config.fleet import Cron, DeployConfig, DeviceClassConfig
from memplan.tasks.config.schema import MAX_SEED, PipelineConfig, RunConfig, load_config, parse_config, registered_solvers
from memplan.tasks.config.matrix import Case, expand_matrix, graph_forms

__all__ = [
    'Addresses', 'Budget', 'Case', 'ConfigError', 'Cron', 'DEVICE', 'DTYPES', 'DeployConfig', 'DeviceClassConfig',
    'IMPORT_PATH', 'InputSpec', 'MAX_BUDGET_BYTES', 'MAX_OVERHEAD', 'MAX_SEED', 'MIN_DEVICE_MEMORY', 'MemplanError',
    'ModelConfig',
    'NAMED_LOSSES', 'PipelineConfig', 'PlanConfig', 'PlanForm', 'PlanSettings', 'ProfileConfig', 'PublishConfig', 'RunConfig', 'Section',
    'TRANSFORMERS_AUTO_CLASSES', 'ValidateConfig', 'VARIANT_RULES', 'VariantChoice', 'expand_matrix', 'graph_forms',
    'load_config',
    'parse_budget', 'parse_budget_text', 'parse_config', 'parse_device_memory', 'parse_device_memory_text', 'parse_max_overhead', 'parse_option_text',
    'registered_solvers',
]
