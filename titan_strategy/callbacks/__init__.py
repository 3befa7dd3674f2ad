"""Lightning callbacks that need to know about the strategy's meshes and process groups."""

from titan_strategy.callbacks.flight_recorder import FlightRecorder
from titan_strategy.callbacks.throughput import Throughput

__all__ = ["FlightRecorder", "Throughput"]
