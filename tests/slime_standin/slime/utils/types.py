"""A stand-in for slime's ``slime.utils.types.Sample``, written for trajbus's tests from the field names,
the nested ``Status`` enum (a plain ``Enum``, not trajbus's ``str`` one) and the ``to_dict``/``from_dict``
behaviour of THUDM/slime's class (``from_dict`` needs ``status`` and keeps keys of no field as attributes).
No code of slime's is in it; tensors are left out (the fields that hold them here hold lists)."""

from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any


@dataclass
class Sample:
    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list = field(default_factory=list)
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: list | None = None
    weight_versions: list = field(default_factory=list)
    rollout_log_probs: list | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        def to_dict(self):
            return {f.name: getattr(self, f.name) for f in fields(self)}

    spec_info: SpecInfo = field(default_factory=SpecInfo)

    @dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        def to_dict(self):
            return {f.name: getattr(self, f.name) for f in fields(self)}

    prefix_cache_info: PrefixCacheInfo = field(default_factory=PrefixCacheInfo)

    def to_dict(self):
        value = dict(self.__dict__)
        value.update(status=self.status.value, spec_info=self.spec_info.to_dict(),
                     prefix_cache_info=self.prefix_cache_info.to_dict())
        return value

    @staticmethod
    def from_dict(data):
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo(**data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo(**data.get("prefix_cache_info", {}))
        names = {f.name for f in fields(Sample)}
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample
