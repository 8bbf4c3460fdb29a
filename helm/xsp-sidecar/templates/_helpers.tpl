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

{{- define "xsp-sidecar.sidecarImage" -}}
{{- printf "%s:%s" .Values.sidecar.image.repository (default .Chart.AppVersion .Values.sidecar.image.tag) -}}
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

{{/*
Settings the chart accepts in values but the sidecar cannot apply yet, and combinations that
cannot work. Each stops the install with a message that says what to change.
*/}}
{{- define "xsp-sidecar.validate" -}}
{{- $sc := .Values.sidecar -}}
{{- if not (kindIs "invalid" $sc.profiling.levels) -}}
{{- fail "sidecar.profiling.levels is not supported yet: `xsp-sidecar serve` has no flag for replay levels (see docs/contracts.md). Leave it null." -}}
{{- end -}}
{{- range $key, $value := $sc.traceStore.retention -}}
{{- if not (kindIs "invalid" $value) -}}
{{- fail (printf "sidecar.traceStore.retention.%s is not supported yet: `xsp-sidecar serve` has no retention flags (see docs/contracts.md). Leave it null." $key) -}}
{{- end -}}
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
{{- $ports := list $sc.listenPort $sc.metricsPort $sc.grpcPort $sc.otlpPort -}}
{{- if eq .Values.backend.type "tfserving" -}}
{{- $ports = concat $ports (list .Values.backend.tfserving.grpcPort .Values.backend.tfserving.restPort) -}}
{{- else -}}
{{- $ports = concat $ports (list .Values.backend.triton.grpcPort .Values.backend.triton.httpPort .Values.backend.triton.metricsPort) -}}
{{- end -}}
{{- if ne (len $ports) (len (uniq $ports)) -}}
{{- fail (printf "two containers of the pod would listen on the same port: %v. Give the sidecar and the backend distinct ports." $ports) -}}
{{- end -}}
{{- end -}}
