"""Checkpoints: their directories, what they record, and what a resume or an export reads.

checkpoint.py       checkpoint directories: atomic commit, validation, discovery for `resume=auto`
layout.py           the parallel layout a Megatron checkpoint was saved with, checked before a resume
base_model.py       the identity of a run's base model, recorded in every checkpoint's manifest
resume_settings.py  the settings a checkpoint was saved with, compared with a resume's
export.py           `tandem export`: a checkpoint's policy as an HF directory
"""
