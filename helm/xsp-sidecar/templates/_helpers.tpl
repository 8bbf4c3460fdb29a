{{/* Chart name, truncated to the 63 characters a label allows. */}}
{{- define "xsp-sidecar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: release name, plus the chart name unless the release already contains it. */}}
{{- define "xsp-sidecar.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "xsp-sidecar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "xsp-sidecar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xsp-sidecar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "xsp-sidecar.labels" -}}
helm.sh/chart: {{ include "xsp-sidecar.chart" . }}
{{ include "xsp-sidecar.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
xsp-sidecar/backend: {{ .Values.backend.type }}
{{- end -}}

{{- define "xsp-sidecar.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "xsp-sidecar.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The sidecar's image; with sidecar.gpu.enabled the tag defaults to the GPU variant's. */}}
{{- define "xsp-sidecar.sidecarImage" -}}
{{- $tag := .Chart.AppVersion -}}
{{- if .Values.sidecar.gpu.enabled -}}
{{- $tag = printf "%s-gpu" .Chart.AppVersion -}}
{{- end -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default $tag .Values.sidecar.image.tag) -}}
{{- end -}}

{{/* sidecar.resources, plus the GPU request of sidecar.gpu (mode resource) as a limit. */}}
{{- define "xsp-sidecar.sidecarResources" -}}
{{- $resources := deepCopy (default dict .Values.sidecar.resources) -}}
{{- $gpu := .Values.sidecar.gpu -}}
{{- if and $gpu.enabled (eq $gpu.mode "resource") -}}
{{- $limits := default dict (get $resources "limits") -}}
{{- $_ := set $limits $gpu.resourceName (int64 $gpu.count) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
{{- toYaml $resources -}}
{{- end -}}

{{- define "xsp-sidecar.traceClaimName" -}}
{{- default (printf "%s-traces" (include "xsp-sidecar.fullname" .)) .Values.sidecar.traceStore.persistence.existingClaim -}}
{{- end -}}

{{/* The backend's gRPC port inside the pod. */}}
{{- define "xsp-sidecar.backendGrpcPort" -}}
{{- if eq .Values.backend.type "tfserving" -}}
{{- .Values.backend.tfserving.grpcPort -}}
{{- else -}}
{{- .Values.backend.triton.grpcPort -}}
{{- end -}}
{{- end -}}

{{/* The backend's HTTP/REST port inside the pod (Triton's HTTP, TF-Serving's REST). */}}
{{- define "xsp-sidecar.backendHttpPort" -}}
{{- if eq .Values.backend.type "tfserving" -}}
{{- .Values.backend.tfserving.restPort -}}
{{- else -}}
{{- .Values.backend.triton.httpPort -}}
{{- end -}}
{{- end -}}

{{/* The name of the backend container's HTTP/REST port. */}}
{{- define "xsp-sidecar.backendHttpPortName" -}}
{{- if eq .Values.backend.type "tfserving" -}}backend-rest{{- else -}}backend-http{{- end -}}
{{- end -}}

{{/* A host for a URL or HOST:PORT: IPv6 literals in brackets. */}}
{{- define "xsp-sidecar.hostForUrl" -}}
{{- if contains ":" . -}}
{{- printf "[%s]" . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* The admin API's --admin-listen address. */}}
{{- define "xsp-sidecar.adminListen" -}}
{{- $admin := .Values.sidecar.admin -}}
{{- printf "%s:%d" (include "xsp-sidecar.hostForUrl" $admin.host) (int64 $admin.port) -}}
{{- end -}}

{{/*
Where Triton, in the same pod, sends its spans: the sidecar's OTLP receiver over loopback
when it binds loopback or every address, else the address it binds.
*/}}
{{- define "xsp-sidecar.otlpUrl" -}}
{{- $sc := .Values.sidecar -}}
{{- $host := $sc.otlpHost -}}
{{- if has $host (list "127.0.0.1" "0.0.0.0" "localhost") -}}
{{- $host = "127.0.0.1" -}}
{{- else if has $host (list "::" "::1") -}}
{{- $host = "::1" -}}
{{- end -}}
{{- printf "http://%s:%d/v1/traces" (include "xsp-sidecar.hostForUrl" $host) (int64 $sc.otlpPort) -}}
{{- end -}}

{{/*
Combinations of values that cannot work. Each stops the install with a message that says
what to change.
*/}}
{{- define "xsp-sidecar.validate" -}}
{{- $sc := .Values.sidecar -}}
{{- if and (hasPrefix "cuda" $sc.profiling.device) (not $sc.gpu.enabled) -}}
{{- fail (printf "sidecar.profiling.device=%s replays on a GPU, but the sidecar's container gets none: set sidecar.gpu.enabled=true (see its comments in values.yaml), or device auto / cpu." $sc.profiling.device) -}}
{{- end -}}
{{- if and (eq .Values.backend.type "triton") .Values.backend.triton.tracing.enabled (eq (int $sc.otlpPort) 0) -}}
{{- fail "sidecar.otlpPort=0 turns the sidecar's OTLP receiver off, but backend.triton.tracing.enabled=true exports Triton's spans to it: set backend.triton.tracing.enabled=false too, or give the receiver a port." -}}
{{- end -}}
{{- if and $sc.traceStore.persistence.enabled (gt (int .Values.replicaCount) 1) (has "ReadWriteOnce" $sc.traceStore.persistence.accessModes) -}}
{{- fail "sidecar.traceStore.persistence.enabled with replicaCount > 1 would make every pod write one ReadWriteOnce trace database: use replicaCount 1, or the emptyDir trace store (persistence.enabled=false)." -}}
{{- end -}}
{{- if and (eq .Values.backend.type "tfserving") (not .Values.backend.tfserving.modelName) (not .Values.backend.tfserving.modelConfigFile) -}}
{{- fail "backend.type=tfserving needs backend.tfserving.modelName or backend.tfserving.modelConfigFile." -}}
{{- end -}}
{{- if and .Values.backend.tfserving.modelName .Values.backend.tfserving.modelConfigFile -}}
{{- fail "set only one of backend.tfserving.modelName and backend.tfserving.modelConfigFile." -}}
{{- end -}}
{{- $declared := list $sc.listenPort $sc.metricsPort $sc.grpcPort -}}
{{- if $sc.http.enabled -}}
{{- $declared = append $declared $sc.http.listenPort -}}
{{- end -}}
{{- if ne (int $sc.otlpPort) 0 -}}
{{- $declared = append $declared $sc.otlpPort -}}
{{- end -}}
{{- if $sc.admin.enabled -}}
{{- $declared = append $declared $sc.admin.port -}}
{{- end -}}
{{- if eq .Values.backend.type "tfserving" -}}
{{- $declared = concat $declared (list .Values.backend.tfserving.grpcPort .Values.backend.tfserving.restPort) -}}
{{- else -}}
{{- $declared = concat $declared (list .Values.backend.triton.grpcPort .Values.backend.triton.httpPort .Values.backend.triton.metricsPort) -}}
{{- end -}}
{{- /* --set gives int64, values files float64: compare them as ints */ -}}
{{- $ports := list -}}
{{- range $declared -}}
{{- $ports = append $ports (int .) -}}
{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "two containers of the pod would listen on the same port: %v. Give the sidecar and the backend distinct ports." $ports) -}}
{{- end -}}
{{- end -}}

{{/*
Where Grafana sends an exemplar's trace_id (the label `ProxyMetrics.record_exemplar` writes):
a tracing datasource in Grafana, or a trace page outside it. A provisioning file expands
environment variables, so the `$` of `${__value.raw}` is written as `$$`.
*/}}
{{- define "xsp-sidecar.traceIdDestination" -}}
{{- $g := .Values.grafana -}}
name: trace_id
urlDisplayLabel: Trace
{{- if $g.tracingDatasourceUid }}
datasourceUid: {{ $g.tracingDatasourceUid | quote }}
{{- else }}
url: {{ replace "$" "$$" $g.traceUrl | quote }}
{{- end }}
{{- end -}}

{{- define "xsp-sidecar.validateGrafana" -}}
{{- $g := .Values.grafana -}}
{{- if not $g.datasource.url -}}
{{- fail "grafana.datasource.enabled needs grafana.datasource.url: the Prometheus that scrapes the sidecars (e.g. http://prometheus-operated.monitoring.svc:9090)." -}}
{{- end -}}
{{- if not (or $g.tracingDatasourceUid $g.traceUrl) -}}
{{- fail "grafana.datasource.enabled links exemplars to traces: set grafana.tracingDatasourceUid (your Tempo or Jaeger datasource in Grafana) or grafana.traceUrl." -}}
{{- end -}}
{{- if and $g.tracingDatasourceUid $g.traceUrl -}}
{{- fail "set only one of grafana.tracingDatasourceUid and grafana.traceUrl." -}}
{{- end -}}
{{- end -}}
