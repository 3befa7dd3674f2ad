"""Lightning callbacks that need to know about the strategy's meshes and process groups."""

from titan_strategy.callbacks.flight_recorder import FlightRecorder

__all__ = ["FlightRecorder"]
