{{/* Chart name, truncated to the 63-character DNS label limit. */}}
{{- define "tinyvllm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "tinyvllm.fullname" -}}
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

{{- define "tinyvllm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (app.kubernetes.io/*, helm.sh/chart). */}}
{{- define "tinyvllm.labels" -}}
helm.sh/chart: {{ include "tinyvllm.chart" . }}
{{ include "tinyvllm.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tinyvllm
{{- end }}

{{/* Selector labels: stable across upgrades, never add mutable values here. */}}
{{- define "tinyvllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tinyvllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{- define "tinyvllm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tinyvllm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The image; by default the tag helm/images/ builds: appVersion, "-cuda" when GPUs are asked. */}}
{{- define "tinyvllm.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- $default := printf "%s%s" .Chart.AppVersion (ternary "-cuda" "" .Values.gpu.enabled) }}
{{- printf "%s:%s" .Values.image.repository (default $default .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Path passed as --model; empty when the server default is used. */}}
{{- define "tinyvllm.modelPath" -}}
{{- $m := .Values.model }}
{{- if eq $m.source "image" }}
{{- $m.path }}
{{- else if $m.subPath }}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.subPath) }}
{{- else }}
{{- $m.mountPath }}
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds: preStop sleep + drain timeout + margin, always > the first two. */}}
{{- define "tinyvllm.terminationGracePeriodSeconds" -}}
{{- $l := .Values.lifecycle }}
{{- add (int $l.preStopSleepSeconds) (int .Values.server.drainTimeoutSeconds) (max 1 (int $l.terminationGraceMarginSeconds)) }}
{{- end }}

{{/* Cross-field checks JSON schema draft-07 cannot express. */}}
{{- define "tinyvllm.validate" -}}
{{- $m := .Values.model }}
{{- if and (eq $m.source "pvc") (not $m.pvc.claimName) }}
{{- fail "model.source=pvc requires model.pvc.claimName" }}
{{- end }}
{{- if and (eq $m.source "hostPath") (not $m.hostPath.path) }}
{{- fail "model.source=hostPath requires model.hostPath.path" }}
{{- end }}
{{- if and (ne $m.source "image") (contains ".." $m.subPath) }}
{{- fail "model.subPath must not contain '..'" }}
{{- end }}
{{- range .Values.engineArgs }}
{{- if hasPrefix "--tensor-parallel-size" (toString .) }}
{{- fail "engineArgs: set tensorParallelSize instead of --tensor-parallel-size (it also sets the GPU limit)" }}
{{- end }}
{{- end }}
{{- $a := .Values.autoscaling }}
{{- if $a.enabled }}
{{- if gt (int $a.minReplicas) (int $a.maxReplicas) }}
{{- fail "autoscaling.minReplicas must be <= autoscaling.maxReplicas" }}
{{- end }}
{{- if and (not $a.queueDepth.enabled) (kindIs "invalid" $a.targetCPUUtilizationPercentage) (empty $a.metrics) }}
{{- fail "autoscaling needs queueDepth.enabled, targetCPUUtilizationPercentage or at least one entry in autoscaling.metrics" }}
{{- end }}
{{- end }}
{{- if and .Values.auth.health (not .Values.auth.apiKeySecretName) }}
{{- fail "auth.health needs auth.apiKeySecretName" }}
{{- end }}
{{- if and .Values.auth.health (or .Values.probes.startup.enabled .Values.probes.liveness.enabled .Values.probes.readiness.enabled) }}
{{- fail "auth.health: the probes cannot send the API key; disable the probes or keep auth.health false" }}
{{- end }}
{{- $p := .Values.podDisruptionBudget }}
{{- if and $p.enabled (not (kindIs "invalid" $p.minAvailable)) (not (kindIs "invalid" $p.maxUnavailable)) }}
{{- fail "podDisruptionBudget: set only one of minAvailable / maxUnavailable (null the other)" }}
{{- end }}
{{- if and $p.enabled (kindIs "invalid" $p.minAvailable) (kindIs "invalid" $p.maxUnavailable) }}
{{- fail "podDisruptionBudget: set one of minAvailable / maxUnavailable" }}
{{- end }}
{{- end }}

{{/* Probe action: the gRPC health service, or with TLS (kubelet gRPC probes speak plaintext
     only) GET /health over HTTPS on the metrics port, which admits clients without a certificate. */}}
{{- define "tinyvllm.probeAction" -}}
{{- if .root.Values.tls.secretName }}
httpGet:
  path: /health
  port: metrics
  scheme: HTTPS
{{- else }}
grpc:
  port: {{ .root.Values.server.grpcPort }}
  {{- with .probe.service }}
  service: {{ . | quote }}
  {{- end }}
{{- end }}
{{- end }}
