# The gateway, signer and registrar image used by compose.yaml.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY pgwcli ./pgwcli
COPY gateway ./gateway
COPY consumers ./consumers
COPY subjects ./subjects
COPY pgwcore ./pgwcore
COPY integrations ./integrations
RUN pip install --no-cache-dir . \
    && useradd --create-home --uid 10001 pgw \
    && mkdir -p /var/lib/pgw && chown pgw /var/lib/pgw
USER pgw
ENV PGW_DATA_DIR=/var/lib/pgw
ENTRYPOINT ["pgw"]
CMD ["gateway"]
