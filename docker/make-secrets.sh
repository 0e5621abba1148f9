#!/usr/bin/env bash
# Creates docker/secrets/ (git-ignored): one random credential per service, readable by its owner only.
# Run once before `docker compose -f docker/compose.yaml up`; it never overwrites an existing secret.
set -euo pipefail
cd "$(dirname "$0")"
umask 077
mkdir -p secrets
random() { python3 -c "import secrets; print(secrets.token_hex(24))"; }
write() { [ -e "secrets/$1" ] || printf '%s' "$2" > "secrets/$1"; }
write ray_token "$(random)"
write postgres_password "$(random)"
write minio_root_user "root-$(random | cut -c1-8)"
write minio_root_password "$(random)"
write minio_user "verl"
write minio_password "$(random)"
write airflow_jwt_secret "$(random)"
# Fernet: 32 random bytes, url-safe base64 (what cryptography.fernet.Fernet.generate_key() makes).
write airflow_fernet_key "$(python3 -c "import base64, os; print(base64.urlsafe_b64encode(os.urandom(32)).decode())")"
pg=$(cat secrets/postgres_password); user=$(cat secrets/minio_user); key=$(cat secrets/minio_password)
write airflow_db_url "postgresql+psycopg2://airflow:${pg}@postgres/airflow"
write aws_credentials "$(printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n' "$user" "$key")"
write airflow_connections "$(python3 - "$user" "$key" <<'PY'
import json, sys
user, key = sys.argv[1:]
print(json.dumps({
    "aws_default": {"conn_type": "aws", "login": user, "password": key,
                    "extra": {"endpoint_url": "http://minio:9000"}},
    "ray_default": {"conn_type": "http", "host": "ray-head", "port": 8265},
}))
PY
)"
# Compose mounts a file secret with its owner and mode: give each to the uid that reads it in its container
# (50000: the image's verl user; 999: postgres; MinIO runs as root).
if [ "$(id -u)" = 0 ]; then
  chown 50000 secrets/{ray_token,airflow_db_url,airflow_connections,airflow_fernet_key,airflow_jwt_secret,aws_credentials}
  chown 999 secrets/postgres_password
else
  echo "not root: run 'sudo chown 50000 docker/secrets/{ray_token,airflow_db_url,airflow_connections,airflow_fernet_key,airflow_jwt_secret,aws_credentials}" \
       "&& sudo chown 999 docker/secrets/postgres_password' so the containers can read their secrets" >&2
fi
ls -l secrets
