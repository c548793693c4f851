{{/* Names, labels and the pieces the three Deployments share. */}}

{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* The name of a component's objects: RELEASE-specdec-drafter (44 characters at most, so that
     "-headless" and "-models" suffixes still fit in 63). */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root | trunc 44 | trimSuffix "-") .component }}
{{- end }}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{/* Labels of objects that belong to the whole release (no component). */}}
{{- define "specdec.releaseLabels" -}}
helm.sh/chart: {{ include "specdec.chart" . }}
app.kubernetes.io/name: {{ include "specdec.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specdec
{{- end }}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image: the role's overrides over .Values.image. */}}
{{- define "specdec.image" -}}
{{- $image := mergeOverwrite (deepCopy .root.Values.image) (.values.image | default dict) }}
{{- printf "%s:%s" $image.repository (toString (default .root.Chart.AppVersion $image.tag)) }}
{{- end }}

{{- define "specdec.imagePullPolicy" -}}
{{- $image := mergeOverwrite (deepCopy .root.Values.image) (.values.image | default dict) }}
{{- $image.pullPolicy }}
{{- end }}

{{/* "true" unless drafter.enabled is false. A values set without the key (e.g. `helm upgrade
     --reuse-values` of a release made before the switch existed) keeps its drafter. */}}
{{- define "specdec.drafterEnabled" -}}
{{- if ne (toString .Values.drafter.enabled) "false" }}true{{ end }}
{{- end }}

{{/* The engines of this release, space-separated: "drafter verifier", or "verifier" without a
     drafter. Every template that makes an engine's objects ranges over this list. */}}
{{- define "specdec.engines" -}}
{{- if include "specdec.drafterEnabled" . }}drafter verifier{{ else }}verifier{{ end }}
{{- end }}

{{/* Where the orchestrator reaches an engine: its headless Service (every pod's address) when it
     has several replicas, else its ClusterIP Service. */}}
{{- define "specdec.engineAddress" -}}
{{- $values := index .root.Values .component }}
{{- $name := include "specdec.componentName" . }}
{{- if gt (int $values.replicas) 1 }}
{{- printf "%s-headless:%d" $name (int $values.port) }}
{{- else }}
{{- printf "%s:%d" $name (int $values.port) }}
{{- end }}
{{- end }}

{{/* The torch device of an engine: its value, else cuda when it asks for GPUs, else cpu. */}}
{{- define "specdec.device" -}}
{{- if .device }}{{ .device }}{{ else if gt (int .gpu.count) 0 }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* True ("true") when an engine's model is a registry name the init container installs. */}}
{{- define "specdec.installsModel" -}}
{{- if and .root.Values.models.install.enabled (not (hasPrefix "/" .values.model)) }}true{{ end }}
{{- end }}

{{/* A probe: the chart's handler (gRPC health on `port`, or its TCP port with `tcp`) and the
     values' timings. */}}
{{- define "specdec.probe" -}}
{{- $handler := dict }}
{{- if .tcp }}
{{- $_ := set $handler "tcpSocket" (dict "port" (int .port)) }}
{{- else }}
{{- $_ := set $handler "grpc" (dict "port" (int .port)) }}
{{- end }}
{{- toYaml (merge $handler (deepCopy (.timings | default dict))) }}
{{- end }}

{{/* Environment of every specdec container (init containers included). */}}
{{- define "specdec.env" -}}
- name: HF_HUB_OFFLINE
  value: "1"
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: MPLCONFIGDIR
  value: /tmp/.cache/matplotlib
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ printf "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME),k8s.deployment.name=%s,service.namespace=%s" (include "specdec.componentName" .) .root.Release.Name | quote }}
{{- with .root.Values.observability.otlp.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $.root.Values.observability.otlp.protocol | quote }}
{{- end }}
{{- range $name, $value := .root.Values.observability.otelEnv }}
- name: {{ $name }}
  value: {{ toString $value | quote }}
{{- end }}
{{- end }}

{{/* The Secret holding the engine token (key `token`): auth.engineTokenSecret, else the one the chart
     makes (engine-token-secret.yaml). Engines always get a token: they refuse to serve a pod address
     open (serve --insecure-engine). */}}
{{- define "specdec.engineTokenSecret" -}}
{{- .Values.auth.engineTokenSecret | default (printf "%s-engine-token" (include "specdec.fullname" .)) }}
{{- end }}

{{/* The /metrics options of a role (port, host, token, TLS), one list item per line. */}}
{{- define "specdec.metricsArgs" -}}
{{- $m := .root.Values.observability.metrics }}
- --metrics-port
- {{ .port | int | quote }}
- --metrics-host
- {{ .root.Values.listenHost | quote }}
{{- if $m.tokenSecret }}
- --metrics-token-file
- /etc/specdec/metrics-token/token
{{- else }}
- --open-metrics
{{- end }}
{{- if $m.tls }}
- --metrics-tls
{{- end }}
{{- end }}

{{/* Volumes every pod has: /tmp, and the TLS / token Secrets when configured. */}}
{{- define "specdec.commonVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmpSizeLimit }}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if and .Values.observability.metrics.enabled .Values.observability.metrics.tokenSecret }}
- name: metrics-token
  secret:
    secretName: {{ .Values.observability.metrics.tokenSecret }}
    defaultMode: 0440
{{- end }}
{{- end }}

{{- define "specdec.commonVolumeMounts" -}}
- name: tmp
  mountPath: /tmp
{{- if .Values.tls.enabled }}
- name: tls
  mountPath: /etc/specdec/tls
  readOnly: true
{{- end }}
{{- end }}

{{/* The /metrics token's mount: in a role's main container only (not in init containers). */}}
{{- define "specdec.metricsTokenMount" -}}
{{- if and .Values.observability.metrics.enabled .Values.observability.metrics.tokenSecret }}
- name: metrics-token
  mountPath: /etc/specdec/metrics-token
  readOnly: true
{{- end }}
{{- end }}

{{/* Checks across values that the schema cannot express; each fails with the value to change. */}}
{{- define "specdec.validate" -}}
{{- if and (gt (int .Values.orchestrator.replicas) 1) (not (or .Values.store.url .Values.store.existingSecret .Values.redis.enabled)) }}
{{- fail "orchestrator.replicas > 1 needs a shared store: set store.url (or store.existingSecret) to an existing Redis, or redis.enabled=true" }}
{{- end }}
{{- if and .Values.store.url .Values.redis.enabled }}
{{- fail "store.url and redis.enabled are both set: choose one store" }}
{{- end }}
{{- if and (eq .Values.models.storage.type "existingClaim") (not .Values.models.storage.existingClaim) }}
{{- fail "models.storage.type is existingClaim: set models.storage.existingClaim to the claim's name" }}
{{- end }}
{{- if and (eq .Values.models.storage.type "hostPath") (not .Values.models.storage.hostPath) }}
{{- fail "models.storage.type is hostPath: set models.storage.hostPath to the node's folder" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt" }}
{{- end }}
{{- if and .Values.tls.requireClientCert (not .Values.tls.enabled) }}
{{- fail "tls.requireClientCert needs tls.enabled" }}
{{- end }}
{{- if and .Values.observability.metrics.tls (not .Values.tls.enabled) }}
{{- fail "observability.metrics.tls serves /metrics with the TLS Secret's certificate: it needs tls.enabled" }}
{{- end }}
{{- if and (not (include "specdec.drafterEnabled" .)) (eq (toString .Values.orchestrator.draftSource) "model") }}
{{- fail "orchestrator.draftSource model needs the draft model: with drafter.enabled=false choose hybrid, lookup or suffix" }}
{{- end }}
{{- if and .Values.orchestrator.http.enabled (eq (int .Values.orchestrator.http.port) (int .Values.orchestrator.port)) }}
{{- fail "orchestrator.http.port must differ from orchestrator.port" }}
{{- end }}
{{- end }}

{{/* The HTTP API's model id: orchestrator.servedModelName, else the verifier's registry name; ""
     (the server's default, the target's model id) for a model given as a path. */}}
{{- define "specdec.servedModelName" -}}
{{- if .Values.orchestrator.servedModelName }}{{ .Values.orchestrator.servedModelName }}
{{- else if not (hasPrefix "/" .Values.verifier.model) }}{{ .Values.verifier.model }}
{{- end }}
{{- end }}
