"""A stand-in for THUDM/slime (not installed here): only ``slime.utils.types.Sample`` and the rollout outputs of
``slime.rollout.base_types``, for trajbus's tests."""
