"""The system as deployed: every actor its own OS process on the real RabbitMQ, real signals."""
