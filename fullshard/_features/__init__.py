"""Features on top of the engine: state dicts, optimizer state dicts, torch's checkpoint API,
``summon_full_params`` and ``clip_grad_norm_``. They take units, never a front door's class."""
