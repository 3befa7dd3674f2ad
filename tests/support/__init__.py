"""What the tests share but do not test: the typed spec of a training run (``run_spec``), the worker that runs it
(``train_worker``, ``user_modules``), its launchers (``fork_launch``, ``launch_server``), the comparisons of runs
(``parity``), and the workers and callbacks of single tests (``simulate_worker``, ``batch_log``)."""
