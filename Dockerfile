FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY actors ./actors
COPY protocol ./protocol
COPY brokers ./brokers
COPY examples ./examples
RUN pip install --no-cache-dir .
USER nobody
CMD ["parkway", "--help"]
