"""The transfer's implementations of the engine's Connector (engine/connector.py): the prefill
side pushes a computed prompt's state (prefill.py), the decode side receives one into a
reservation (decode.py); both drive one endpoint per engine rank (base.py, transfer/rank.py)."""

from transfer.connector.decode import DecodeConnector, ReservationPhase
from transfer.connector.prefill import PrefillConnector, PushParams, PushPhase

__all__ = ["DecodeConnector", "PrefillConnector", "PushParams", "PushPhase", "ReservationPhase"]
