{{/* Names and labels shared by every object of the release. */}}

{{- define "unroll.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "unroll.fullname" -}}
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

{{- define "unroll.selectorLabels" -}}
app.kubernetes.io/name: {{ include "unroll.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "unroll.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "unroll.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The serving image: the GPU image when gpu.enabled, else the CPU image. */}}
{{- define "unroll.image" -}}
{{- $img := ternary .Values.gpu.image .Values.image .Values.gpu.enabled -}}
{{- printf "%s:%s" $img.repository ($img.tag | toString) -}}
{{- end }}

{{/* Triton's metrics as Prometheus scrapes them: the bridge's port when the bridge runs, else Triton's own. */}}
{{- define "unroll.metricsPort" -}}
{{- ternary .Values.metrics.bridge.port .Values.metrics.tritonPort .Values.metrics.bridge.enabled -}}
{{- end }}
