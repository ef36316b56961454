{{/* Release-scoped base name: "gpu-topology" for a release of that name, "<release>-gpu-topology" otherwise. */}}
{{- define "gpu-topology.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "gpu-topology.labels" -}}
app.kubernetes.io/part-of: gpu-topology
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: call with (dict "ctx" $ "name" "plugin"). */}}
{{- define "gpu-topology.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-topology.fullname" .ctx }}-{{ .name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- end -}}

{{- define "gpu-topology.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}

{{- define "gpu-topology.leaseName" -}}
{{- default .Values.scheduler.schedulerName .Values.scheduler.leaderElection.resourceName -}}
{{- end -}}

{{/* The extender entry of a KubeSchedulerConfiguration; (dict "ctx" $ "url" ... "tls" <tlsConfig or nil>). */}}
{{- define "gpu-topology.extenderEntry" -}}
{{- $v := .ctx.Values -}}
- urlPrefix: {{ .url }}
  filterVerb: filter
  prioritizeVerb: prioritize
  preemptVerb: preempt
  bindVerb: bind
  weight: {{ $v.scheduler.weight }}
  nodeCacheCapable: {{ $v.scheduler.nodeCacheCapable }}
  enableHTTPS: {{ if .tls }}true{{ else }}false{{ end }}
  {{- with .tls }}
  tlsConfig:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  httpTimeout: {{ $v.scheduler.httpTimeout }}
  ignorable: {{ $v.scheduler.ignorable }}
  managedResources:
    - name: {{ $v.resourceName }}
      ignoredByScheduler: false
{{- end -}}

{{/* Arguments shared by every extender container. */}}
{{- define "gpu-topology.extenderArgs" -}}
- --resource-name={{ .Values.resourceName }}
- --annotation-prefix={{ .Values.annotationPrefix }}
- --reservation-timeout={{ .Values.extender.reservationTimeout }}
{{- range .Values.extender.extraArgs }}
- {{ . }}
{{- end }}
{{- end -}}

{{- define "gpu-topology.metricsFrom" -}}
{{- with .Values.networkPolicy.metricsFrom }}
from:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
