from pydantic import BaseModel, ConfigDict, Field


class ArithConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    digits: int = Field(2, ge=1, le=4, description="digits per operand (zero-padded)")
    eval_size: int = Field(500, gt=0, description="held-out problems for evaluation (never trained on)")
    teacher_carry_accuracy: float = Field(
        0.3, ge=0, le=1, description="how often the demonstrating teacher gets a problem with a units "
        "carry right; otherwise it forgets the carry (answers a+b-10). Problems without a units carry "
        "are always right.")
    demos_per_task: int = Field(4, gt=0, description="teacher answers per training problem, each drawn "
                                "independently (so the teacher's carry mistakes are noise to imitate, "
                                "not labels to memorise)")
    data_seed: int = Field(1234, description="seed of the train/eval split and of the teacher's "
                                             "mistakes (fixed across run seeds)")
    export_dir: str | None = Field(None, description="write the data out as dataset files when the env "
                                   "is built: <dir>/train.jsonl (the teacher's demonstrations) and "
                                   "<dir>/eval.jsonl (held-out problems); kept if already written "
                                   "with the same settings (see python -m miles_plugin_arith.export_data)")
