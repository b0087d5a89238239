"""A stand-in for THUDM/slime (not installed here): only ``slime.utils.types.Sample``, for trajbus's tests."""
