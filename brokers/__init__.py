"""Transports behind one small interface (``base.Broker``): RabbitMQ and an in-memory twin."""

from parkway.brokers.base import (
    Broker,
    BrokerError,
    Consumer,
    DeadLetter,
    Delivery,
    Envelope,
    RequestTimeout,
    Unroutable,
)
from parkway.brokers.factory import connect

__all__ = [
    "Broker",
    "BrokerError",
    "Consumer",
    "DeadLetter",
    "Delivery",
    "Envelope",
    "RequestTimeout",
    "Unroutable",
    "connect",
]
