"""Flight Recorder dumps: writing them (``dump``, ``watchdog``), reading and explaining them (``analyze``,
``timeline``, the ``titan-fr`` command in ``cli``). The Lightning callback is ``titan_strategy.FlightRecorder``."""
