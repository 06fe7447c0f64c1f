"""What builds and judges decision heads; nothing that runs inside an agent imports it.

Labeled rows (:mod:`~clef_guard.training.examples`, :mod:`~clef_guard.training.datasets`,
generated :mod:`~clef_guard.training.rows`) -> backbone features
(:mod:`~clef_guard.training.features`) -> a fitted head (:mod:`~clef_guard.training.fit`,
optionally a LoRA adapter: :mod:`~clef_guard.training.lora`) -> temperatures and thresholds
(:mod:`~clef_guard.training.calibrate`) -> reports (:mod:`~clef_guard.training.evaluate`).
Needs ``pip install 'clef-guard[train]'``.
"""
