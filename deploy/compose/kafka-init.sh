#!/usr/bin/env bash
# One-shot init of the compose Kafka: a SCRAM-SHA-512 user per service and the ACLs that let only the
# owning service write its topic (docs/security.md). Runs as the broker's super user `admin` (PLAIN,
# from the broker's JAAS config); idempotent, so `docker compose up` may run it on every start.
set -euo pipefail
BOOTSTRAP=kafka:9092
BIN=${KAFKA_BIN:-/opt/kafka/bin}  # the Kafka CLI (the image's; tests/repo/test_kafka_acls.py runs the script on stand-ins)
CONFIG=$(mktemp)
trap 'rm -f "$CONFIG"' EXIT
cat > "$CONFIG" <<PROPS
security.protocol=SASL_PLAINTEXT
sasl.mechanism=PLAIN
sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required username="admin" password="${KAFKA_ADMIN_PASSWORD}";
PROPS

until "$BIN/kafka-broker-api-versions.sh" --bootstrap-server "$BOOTSTRAP" --command-config "$CONFIG" >/dev/null 2>&1; do
  echo "waiting for kafka at $BOOTSTRAP"; sleep 2
done

user() {  # user NAME PASSWORD
  "$BIN/kafka-configs.sh" --bootstrap-server "$BOOTSTRAP" --command-config "$CONFIG" --alter \
    --entity-type users --entity-name "$1" --add-config "SCRAM-SHA-512=[iterations=8192,password=$2]" >/dev/null
  echo "user $1"
}
acl() {  # acl PRINCIPAL --operation ... --topic|--group ...
  local principal=$1; shift
  "$BIN/kafka-acls.sh" --bootstrap-server "$BOOTSTRAP" --command-config "$CONFIG" --add --force \
    --allow-principal "User:$principal" "$@" >/dev/null
  echo "acl $principal $*"
}
owns() {  # owns SERVICE TOPIC: only SERVICE writes TOPIC (and creates it and its dead-letter topic)
  acl "$1" --operation Write --operation Describe --operation Create --topic "$2"
  acl "$1" --operation Describe --operation Create --topic "$2.dlq"
}
reads() {  # reads SERVICE TOPIC GROUP [prefixed]: SERVICE consumes TOPIC in GROUP, dead-letters to TOPIC.dlq
  acl "$1" --operation Read --operation Describe --operation Create --topic "$2"
  acl "$1" --operation Write --operation Describe --operation Create --topic "$2.dlq"
  if [ "${4:-}" = prefixed ]; then
    acl "$1" --operation Read --operation Describe --group "$3" --resource-pattern-type prefixed
  else
    acl "$1" --operation Read --operation Describe --group "$3"
  fi
}

user bundle-store "$KAFKA_BUNDLE_STORE_PASSWORD"
user job-orchestrator "$KAFKA_JOB_ORCHESTRATOR_PASSWORD"
user inference-router "$KAFKA_INFERENCE_ROUTER_PASSWORD"
user trace-collector "$KAFKA_TRACE_COLLECTOR_PASSWORD"
user fl-coordinator "$KAFKA_FL_COORDINATOR_PASSWORD"
user monitoring-scorer "$KAFKA_MONITORING_SCORER_PASSWORD"
user automl-controller "$KAFKA_AUTOML_CONTROLLER_PASSWORD"
user tracer "$KAFKA_TRACER_PASSWORD"  # the tracers inside jobs (the job-orchestrator hands it to jobs)

owns bundle-store opml.bundles.v1
owns job-orchestrator opml.jobs.v1
owns job-orchestrator opml.pipelines.v1
owns inference-router opml.predictions.v1
owns inference-router opml.deployments.v1
owns fl-coordinator opml.federations.v1
owns automl-controller opml.experiments.v1
reads inference-router opml.bundles.v1 inference-router-autodeploy
reads job-orchestrator opml.bundles.v1 job-orchestrator-pipeline-spans  # committed spans start pipeline runs
reads job-orchestrator opml.alerts.v1 job-orchestrator-pipeline-alerts  # alerts of the models pipelines push
acl tracer --operation Write --operation Describe --topic opml.traces.v1
reads trace-collector opml.traces.v1 trace-collector. prefixed  # groups trace-collector.<generation>
reads automl-controller opml.traces.v1 automl-controller-traces  # the Trace metrics collector
owns monitoring-scorer opml.alerts.v1
owns monitoring-scorer opml.quality.v1
reads inference-router opml.quality.v1 inference-router-quality  # the rollouts' quality checks
reads monitoring-scorer opml.deployments.v1 monitoring-scorer-deployments
# the faust app (group monitoring-scorer) reads predictions and labels, and owns its changelog topics
reads monitoring-scorer opml.predictions.v1 monitoring-scorer
reads monitoring-scorer opml.labels.v1 monitoring-scorer
# and writes the labels users send through SubmitLabels (opml monitor label), as the platform's label source
acl monitoring-scorer --operation Write --topic opml.labels.v1
acl monitoring-scorer --operation All --topic monitoring-scorer- --resource-pattern-type prefixed
echo "kafka users and ACLs are in place"
