FROM python:3.11-slim
WORKDIR /app
# What building the wheel needs, and nothing else (see .dockerignore).
COPY pyproject.toml setup.py README.md ./
COPY actors ./actors
COPY protocol ./protocol
COPY brokers ./brokers
COPY scripts/install-wheel ./scripts/install-wheel
# The same install step as tests/test_wheel.py: build the wheel, install it (not editable).
RUN sh scripts/install-wheel .
# The ``tracing`` extra (the OpenTelemetry SDK and its OTLP/HTTP exporter): traces stay off until
# OTEL_TRACES_EXPORTER is set (compose.yaml, docs/tracing.md).
RUN python -m pip install --no-cache-dir "opentelemetry-sdk>=1.27" "opentelemetry-exporter-otlp-proto-http>=1.27"
COPY examples ./examples
# A user of its own, with a home (Ray and pip want one), owning the state directory: a fresh named
# volume mounted there (compose's parkway-state) takes this directory's owner, so it is writable.
RUN useradd --create-home --uid 10001 parkway \
    && mkdir -p /var/lib/parkway \
    && chown parkway:parkway /var/lib/parkway
USER parkway
ENV PARKWAY_STATE_DIR=/var/lib/parkway
CMD ["parkway", "--help"]
