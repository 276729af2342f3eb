"""Options, presets and their checks: keyword-only dataclasses, the single source of truth of every option,
default and help text. The CLI builds its flags from their fields (cli.py), `--config FILE.toml` fills them,
and checkpoints and benchmark results store them; every field is checked when a config is made.

    python -c "from gptopt.config import preset; print(preset('tiny'))"

fields.py: the limits, `opt` and check_fields; model.py: GPTConfig and the presets; sampling.py: the sampling
options and their bounds (those from gptopt.config.sampling); train.py and infer.py: the commands' configs.
Import from here.
"""

from gptopt.config.fields import (
    MAX_BATCH,
    MAX_LAYERS,
    MAX_NEW_TOKENS,
    MAX_PAD_MULTIPLE,
    MAX_SECONDS,
    MAX_SEED,
    MAX_SEQ_LEN,
    MAX_SLOTS,
    MAX_STEPS,
    MAX_THREADS,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    MAX_WORKERS,
    check_fields,
    field_types,
    opt,
    range_text,
    type_ok,
)
from gptopt.config.infer import (
    EVAL_TASKS,
    INFER_QUANTIZE,
    MAX_EXAMPLES,
    MIN_OPSET,
    QUANTIZE_METHODS,
    CompressConfig,
    EvalConfig,
    ExportConfig,
    GenerateConfig,
    LoadtestConfig,
    ServeConfig,
    parse_prune,
)
from gptopt.config.model import (
    ARCH_FIELDS,
    DATA_VOCAB_PRESETS,
    DEFAULT_PRESET,
    LOSSES,
    PRESETS,
    GPTConfig,
    arch_overrides,
    check_seq_len,
    preset,
    preset_for_data,
)
from gptopt.config.sampling import Bound, SamplingConfig
from gptopt.config.train import (
    COMPILE_MODES,
    DOCTOR_SEQ_LEN,
    MUON_LR,
    TUNE_AXES,
    BenchConfig,
    DoctorConfig,
    PrepareConfig,
    ProfileConfig,
    TrainConfig,
    TuneConfig,
    check_loader,
    parse_duration,
)
