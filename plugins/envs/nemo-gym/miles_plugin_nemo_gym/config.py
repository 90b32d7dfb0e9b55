from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

DATA = Path(__file__).parent / "gym" / "resources_servers" / "miles_arith" / "data"


class NemoGymConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent_url: str = Field("http://127.0.0.1:8100", description="base URL of the NeMo Gym agent server "
                           "(started by ng_run; `python -m miles_plugin_nemo_gym.launch` prints it); "
                           "rollouts POST each task's row to its /run")
    train_file: str = Field(str(DATA / "train.jsonl"), description="JSONL of NeMo Gym rows (each with "
                            "responses_create_params and the fields its resources server verifies "
                            "against); default: the bundled miles_arith sums")
    eval_file: str = Field(str(DATA / "eval.jsonl"), description="JSONL of NeMo Gym rows for evaluation")
    demo_field: str = Field("teacher_answer", description="row field holding a reference answer text: "
                            "the train rows that have it are the demonstrations of run.warm_start "
                            "(the bundled miles_arith rows carry a sloppy teacher's answer)")
    timeout_s: float = Field(120.0, gt=0, description="seconds one /run (a whole agent trajectory) may "
                             "take; past it that sample is marked failed and left out of training")
    connect_timeout_s: float = Field(10.0, gt=0, description="seconds to connect to the agent server")
    max_concurrency: int = Field(32, gt=0, description="/run requests in flight at once")


class NemoGymRolloutConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_failed_fraction: float = Field(0.5, ge=0, le=1, description="a rollout batch in which more "
                                       "than this fraction of trajectories failed is an error "
                                       "(the servers are down or misconfigured), not a training step")
